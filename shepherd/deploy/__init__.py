"""Deploying shepherd beyond one machine.

    ray_serve.py   the library entry: build_app(options, serve_args) -> a Ray Serve application
    ray_cli.py     `shepherd ray-serve`: the same, deployed from the command line
    ray_replica.py one shepherd replica (engine, engine-core process, shepherd's own OpenAI app)
    ray_ingress.py the OpenAI ingress: reads a request, routes it, retries, relays the answer
    ray_router.py  shepherd's routing policies as Ray Serve's request router

Ray is an extra (`pip install 'shepherd[ray]'`): only ray_cli.py imports
without it. docs/DEPLOY.md says which deployment to use when.
"""
