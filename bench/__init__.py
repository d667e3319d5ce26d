"""The lab: kvmesh's benchmarks, simulators, fuzzer and profilers, apart from the product.

Everything here imports the product (kvmesh/, gateway/, the services, runtime/, engine/,
kvstore/, kernels/) and nothing in the product imports it (tests/unit/test_import_layers.py
holds both). What lives here:

- whole-mesh measurements, the `kvmesh` subcommands of bench/cli.py (registered as entry
  points, so the product's CLI never names them): `kvmesh bench` (mesh.py; `--speculative`:
  speculative.py; `--trace`: trace.py with trace_plots.py), `kvmesh bench-v4` (v4.py),
  `kvmesh bench-transfer` (transfer.py, next to Mooncake TE in mooncake.py), `kvmesh routesim`
  (routesim.py over the simulation in routing_sim.py, and SGLang's router in sglang_router.py
  with sglang_router_process.py and sglang_stub_workers.py), `kvmesh fuzz` (fuzz.py, its
  requests from fuzz_cases.py, its report in fuzz_report.py);
- the peers the mesh is measured against, each in a process of its own (peers.py);
- the engine and kernels alone, `python -m bench.NAME`: engine.py, prefill.py,
  profile_decode.py, v4_state_report.py, kernels_gpu.py, quant.py, dense.py;
- fault measurements on a running mesh: fault_burst300.py, fault_freeze.py.
"""
