"""The memory proxy (SPEC section 16), free of aiohttp: a project's upstream model (:mod:`.upstream`), what
a chat completion request becomes on its way upstream (:mod:`.requests`), and the binding to a conversation
with the memory message it brings (:mod:`.binding`). The HTTP side (the upstream client, the streaming
writer, the routes) is service/http/proxy_routes.py and service/http/proxy_client.py."""
