"""What the studio did: a record per request and per load or eviction, kept, shown live and read back.

``trace`` follows one request through the forward path (a handful of time stamps, set where the
path already is: no hook parses a chunk); ``loads`` turns the manager's ``ResidencyEvent`` stream
into load and eviction records; ``recorder`` owns the live set, the subscribers and the batched
writes into the history database (``store``); ``api`` serves ``/api/activity``; ``captures`` keeps
the bodies of failed requests when asked to.
"""
