"""Data in: JSONL/CSV records, task encoders, and a resumable rank-sharded loader."""

from kiln.data.encode import Fields, collect_labels, fields_of
from kiln.data.loader import Loader, pad_collate
from kiln.data.records import Record, read_records

__all__ = [
           "Fields",
           "Loader",
           "Record",
           "collect_labels",
           "fields_of",
           "pad_collate",
           "read_records",
]
