#!/bin/sh
# gRPC's EventEngine client/listener (grpcio's default) against its iomgr poller, served_overhead
# alternated (session 25). "default" sets GRPC_EXPERIMENTS empty: pdserve leaves a set variable
# alone, so that side runs grpcio's own default; "off" is what pdserve now sets (as run here it
# also named event_engine_dns, which grpcio 1.85 does not know: it logs that and ignores it).
cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3; do
  for e in default off; do
    x=""; [ $e = off ] && x="-event_engine_client,-event_engine_listener,-event_engine_dns"
    GRPC_EXPERIMENTS="$x" .venv/bin/python -m pdserve.bench.served_overhead --dtype bfloat16 --streams 1,64 --rounds 1 --json docs/bench/served-overhead-s25/$e.$r.json 2>&1 | grep "round\|CPU us" | sed "s/^/$e $r: /"
  done
done
