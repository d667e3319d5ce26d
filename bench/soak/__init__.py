"""`kvmesh soak` (issue 45): every feature under faults, for a given time, with nothing lost and
nothing wrong.

    mesh.py      the mesh on hosts (bench/hosts.py): Redis, two gateways, two prefill and two
                 decode instances, each on a host of its own; its services' lives (started,
                 killed, frozen, crashed) and their samples (pages, RSS)
    workload.py  the mixed, seeded requests through the real clients, and their check against
                 a quiet reference run
    faults.py    the seeded fault schedule, one fault at a time, each undone before the next
    report.py    the run's JSON (sent, finished, failed, hung, wrong, crashed, leaked_pages,
                 rss_slope_mb_per_hour, faults) and its plot
    run.py       the command: `kvmesh soak --duration SECONDS --seed N --json PATH`
"""
