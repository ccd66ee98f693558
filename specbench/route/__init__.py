"""Per-prompt routing: which method and K each prompt gets (`router.py`), and runs that use it (`auto.py`)."""
