"""Real clusters: launch vLLM instances (launcher), route with the simulator's policies
(router), replay workloads (driver), measure (telemetry); `backend` ties them together as
the `cluster` backend. Submodules are imported on demand so the CLI stays fast."""
