"""Persisting closed files to the durable tier: the policy (what and when) and
the uploader (how, in the background, markers last)."""
