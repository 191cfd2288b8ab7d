"""The serving engine behind an OpenAI-compatible HTTP endpoint.

``python -m instruments server``: where the field's load generators (guidellm, ``vllm bench
serve``) reach it.

  core     the engine core: a process of its own owning the model and one
           ``engine.serving.ServingEngine``, stepping while it has work; pipes in and out
  app      the front end: a Starlette app (uvicorn) for /v1/completions and
           /v1/chat/completions (SSE streams or whole bodies), /v1/models, /health, /metrics
  api      OpenAI's request and response bodies, checked (torch-free, no I/O)
  metrics  the Prometheus text of /metrics, under vLLM's names
  cli      the ``server`` command: flags, checks before anything loads, start and stop
  report   guidellm's JSON report read into a run of ours (kind "serving_http")

The front end never steps the model: the core's process does, so no HTTP, JSON or tokenizer
work shares the interpreter of a timed step (docs/serving-http.md).
"""
