"""HTTP layer: routes (parse, call the domain, serialise), the error middleware, schemas, OpenAPI."""
