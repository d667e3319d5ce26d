"""`kvmesh plan`: sizing a mesh to a workload and a latency target (`kvmesh up --autoscale`, in
kvmesh/autoscale.py, follows the load online).

workload.py   what the mesh will serve: a Mooncake trace, or rates and length distributions
profile.py    what one prefill and one decode cost on this hardware and model
measure.py    measuring a profile on a running mesh, through its gateway
simulate.py   a mesh of P prefill and D decode instances replaying a workload, by the profile
search.py     the least-cost configuration whose simulated latencies meet the SLO
command.py    the command: workload + SLO (+ profile) -> a printed plan, `--apply` starts it
"""
