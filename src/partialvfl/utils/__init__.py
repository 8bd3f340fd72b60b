"""Small shared utilities (seeding, progress)."""
