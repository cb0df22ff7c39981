"""Integrations of kvxfer into inference engines, one package per engine, each on kvxfer's
public API only (``Engine``, ``KVLayout``, ``Sharding``, ``Messenger``)."""
