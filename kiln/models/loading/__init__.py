"""Loading a checkpoint: one load plan (the model on meta, one typed source per tensor) and one materialization
that fills each rank's pieces (plan.py, read.py; fp8.py, q4.py, carried.py, fresh.py, stage.py per kind of source).
"""
