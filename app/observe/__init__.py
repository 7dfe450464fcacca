"""What a run shows: meters reduced across ranks, throughput and MFU (metrics.py); what rank 0 writes (runlog.py)."""
