"""The worker side of training: the session, its step loop, and in-process recovery.

Public names are re-exported by :mod:`elastictrain`.
"""
