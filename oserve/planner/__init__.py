"""The planner: OServe's decision, one brain for the simulator and the live system.

Forecast rates, the decision in force and the arrivals of the last span go in; a `Decision` (a
deployment and which replicas may serve each class) comes out (`OServePlanner.plan`). The live
scheduler worker and the simulator's OServe policy call the same object; nothing here knows which.
Pure: no asyncio, NATS or clock.

- `context`: what planning needs of the model, cluster, capacity table and switch costs.
- `candidates`: deployments worth considering, assignments over them, placement that keeps replicas.
- `twin`: the digital twin that scores a deployment by simulating the forecast span.
- `neighbours`: the local search over deployments one move away.
- `config`: every threshold of the planner, named, with its reason.
- `oserve`: the planner itself.
- `static`: the static baseline's decision (one deployment, every class everywhere), for the live demo's
  static run and the simulator's vllm-static alike.
"""
