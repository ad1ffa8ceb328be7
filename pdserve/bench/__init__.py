"""pdserve's benchmark load generator, as a library.

- `pdserve.bench.workloads`: seeded request lists (`fixed`, `mixed`, `long-prompt`,
  `shared-prefix`) with prompts sized exactly by the real tokenizer, and arrival schedules
  (all at once, Poisson, rate sweeps);
- `pdserve.bench.clients`: `BenchClient` and its implementations (OpenAI-compatible HTTP with
  streaming SSE, pdserve's gRPC gateway) that time every streamed token;
- `pdserve.bench.metrics`: TTFT, TPOT, inter-token and end-to-end latency percentiles,
  throughput and goodput under SLOs, as a JSON-ready `BenchReport`;
- `pdserve.bench.runner`: replays a workload on its schedule with bounded concurrency;
- `pdserve.bench.plots`: latency CDFs and rate-sweep figures;
- `pdserve.bench.loadgen`: the `pdserve bench` command line (`main(argv)`).
"""
