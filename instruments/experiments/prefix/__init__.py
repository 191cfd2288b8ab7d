"""The prefix cache's experiments, one module each.

Registered in ``instruments.experiments`` as ``prefix_ttft``, ``prefix_chat`` and
``prefix_workload``:

  ttft      TTFT against the cached prefix, with its prediction beside it
  chat      a multi-turn chat with and without prefix reuse
  workload  requests sharing system prompts and documents under KV budgets
  parts     what they share: seeded ids, a budget's bytes, one served request, the load average
"""
