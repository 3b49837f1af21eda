"""Webhooks (SPEC sections 11 and 14): a project's endpoints (:mod:`.service`), where they may point
(:mod:`.policy`), their signing secrets (:mod:`.secrets`), the delivery of the queue (:mod:`.delivery`) and what
receivers get (:mod:`.views`)."""
