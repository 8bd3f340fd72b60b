"""A party and a coordinator at work: the party runtime (a program under its party's policy and budget), the
federation the coordinator fits through (in process: :class:`~.coordinator.LocalFederation`) and checkpoints.
Imports ``wire``, ``dp`` and ``trust``; the gRPC deployment builds on it."""
