"""The ``LocalLedger`` by area: each module adds the methods of one area to the facade in ``local_ledger.py``."""
