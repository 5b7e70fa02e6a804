"""One HTTP client for the tests' plain requests to a server.

`httpx.get(...)` and its siblings build a client per call, and each client loads the CA bundle into a new SSL
context (~30 ms of CPU on the 2-core machine, even for http:// URLs): over the suite's requests, seconds. This client
keeps no idle connection, so each request still opens and closes its own, as a one-call client does, and it has no
connection limit, so concurrent requests never queue here.
"""

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
