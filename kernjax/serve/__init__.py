"""Serving: head and stage processes, protocol, transport, HTTP."""
