"""Thin API routers: parse, call server.serving, return."""
