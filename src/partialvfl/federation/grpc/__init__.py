"""The gRPC deployment: the party server, the coordinator's federation and transport over mutual TLS, its limits
and sessions, the parties' set-up files (``party.toml``, certificates, templates) and a local multi-process
deployment.  Highest of federation's sub-packages."""
