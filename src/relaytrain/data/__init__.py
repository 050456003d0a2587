"""Data: prepare token files, the pure data order, the loader, the ledger and its audit."""
