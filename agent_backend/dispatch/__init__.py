"""Dispatch: run prepared tool calls on a backend's hosts, in sessions, with bounded output."""
