"""The wire core: messages and their declarations, the party-program contract, transports, a party's refusal.

Lowest of federation's sub-packages: it imports none of ``dp``, ``trust``, ``runtime`` or ``grpc``."""
