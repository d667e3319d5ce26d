"""`kvmesh soak` (issue 45): every feature under faults, for a given time, with nothing lost and
nothing wrong.

    mesh.py      the mesh on hosts (bench/hosts.py): Redis, two gateways, two prefill and two
                 decode instances, each on a host of its own; its services' lives (started,
                 killed, frozen, crashed) and their samples (pages, RSS)
    workload.py  the mixed, seeded requests, and their answers' check against a quiet
                 reference run's
    clients.py   the real clients, one per gateway and key (openai and anthropic over HTTP,
                 GatewayClient over gRPC), and the status a client's error names
    send.py      each kind sent through them and judged; the reference run; the load's workers
    faults.py    the seeded fault schedule, one fault at a time, each undone before the next
    report.py    the run's JSON (sent, finished, failed, hung, wrong, crashed, leaked_pages,
                 rss_slope_mb_per_hour, faults, by_fault_kind) and its plot
    run.py       the command: `kvmesh soak --duration SECONDS --seed N --json PATH`
"""
