"""The simulator: engine replicas with continuous batching, the cluster kernel, policies, workloads."""
