"""Differential privacy a party keeps over what it releases (its own budget per row, the accountant).

Above ``wire`` only: the policy (``trust``) and the party runtime read it, never the reverse."""
