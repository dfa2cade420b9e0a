"""The `atomc` command: `main.py` holds the commands, `flags.py` the engine flags they share,
`cache.py` the `atomc cache` sub-app."""
