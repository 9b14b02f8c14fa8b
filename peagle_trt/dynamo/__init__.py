"""`peagle-trt dynamo`: peagle-trt workers behind NVIDIA Dynamo's frontend and KV-aware router.

Layout: options.py (settings, confinement of Dynamo's planes), engine.py (the Dynamo LLMEngine over
our generator), events.py (paged-cache prefix events -> Dynamo KV events), worker.py (run a worker,
the frontend's command), cli.py (the subcommand). Needs .venv-dynamo (scripts/dynamo_env.sh);
docs/DEPLOY.md; tests/dynamo/.
"""
