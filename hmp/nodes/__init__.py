"""Daemon shells: each role's node moves frames between sockets and its sans-IO core."""
