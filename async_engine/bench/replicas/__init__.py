"""`async-engine bench replicas`: K `serve` replicas behind a router, against them direct.

Starts K replicas of `async-engine serve` (the simulated device by default), each behind a
tap (``tap.py``: a byte relay that notes which prompt group each request belongs to), puts
the chosen router in front (``routers.py``: vllm-router, Ray Serve or none), and sends
groups of streamed requests whose prompts share long prefixes (``workload.py``) through
the router, to one replica direct and to all K direct in client-side round robin. It prints
throughput, TTFT and ITL percentiles, tokens per streamed event, each replica's share of
the requests (its /metrics), prefix affinity and cached prompt tokens against the most
that could have been cached, and how long a client's disconnect takes to abort the request
on its replica (``cancel.py``). ``command.py`` runs it all; ``report.py`` prints it.
"""
