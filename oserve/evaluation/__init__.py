"""The evaluation: OServe against the baselines on the same scenarios, honestly. Pure (no clock but a
timer handed in, no files but the traces named).

- `scenarios`: a history and a window of requests, scaled to a cluster.
- `policies`: the gateway every policy runs (classify at arrival, learn at completion, route by the
  one rule), OServe's policy, and the perfect-forecast reference.
- `baselines`, `llumnix`, `dynamo`: vLLM static (least-loaded or round robin), vLLM reload, a
  Llumnix-like migrating balancer, a Dynamo-like replica-count planner.
- `registry`: every policy by name, with what it is.
- `compare`: every policy on one scenario; speedups that never reward serving fewer requests.
- `bounds`, `ceiling`: a true lower bound on P99, and the best fixed deployment.
- `noise`: how much of a P99 ratio is the window's draw (a paired block bootstrap over its minutes).
- `tuning`: thresholds tuned on one set of scenarios, reported on another.
"""
