"""pdserve's benchmark load generator, as a library.

- `bench.workloads`: seeded request lists (`fixed`, `mixed`, `long-prompt`,
  `shared-prefix`) with prompts sized exactly by the real tokenizer, and arrival schedules
  (all at once, Poisson, rate sweeps);
- `bench.clients`: `BenchClient` and its implementations (OpenAI-compatible HTTP with
  streaming SSE, pdserve's gRPC gateway) that time every streamed token;
- `bench.metrics`: TTFT, TPOT, inter-token and end-to-end latency percentiles,
  throughput and goodput under SLOs, as a JSON-ready `BenchReport`;
- `bench.runner`: replays a workload on its schedule with bounded concurrency;
- `bench.plots`: latency CDFs and rate-sweep figures;
- `bench.loadgen`: the `pdserve bench` command line (`main(argv)`).
"""
