"""Trust and policy: what a party agrees to run (its policy and guards), whom it trusts (certificate pins), how IDs
are aligned without revealing them (HMAC and private set union), its lookup budget, access log and the raw-feature
audit.  Imports ``wire`` and ``dp``; never the runtime or the gRPC deployment."""
