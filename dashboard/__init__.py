"""The swarm dashboard: a read-only FastAPI service and one static page.

Two ways to run it, one app: embedded in a node (`diloco-node join --dashboard-port 8000`),
reading the Node object, or standalone (`diloco-node dashboard --peers MADDR`), reading the
swarm's signed heartbeats as a client-mode DHT member that trains nothing.
"""
