"""The server as replicas on Ray Serve, routed by the documents they hold (``cacheblend-rag serve --ray``).

- :mod:`~cacheblend_rag.server.replicas.routing`: which replica a request goes to (no Ray needed);
- :mod:`~cacheblend_rag.server.replicas.router`: that choice as Ray Serve's ``RequestRouter``;
- :mod:`~cacheblend_rag.server.replicas.asgi`: the single server's app run inside a replica;
- :mod:`~cacheblend_rag.server.replicas.deployments`: the front end and the engine replicas;
- :mod:`~cacheblend_rag.server.replicas.launch`: the application and the command.

Only ``routing`` imports without the ``[ray]`` extra; docs/operations.md says how to run it.
"""
