"""Read back what each tracker of earl_megatron/trackers wrote offline, with its own reader.

``read(name, out_dir)`` -> ``(series, config)``: series is {key: {step: value}} of every scalar
the tracker holds for the run under ``out_dir``, config the configuration it recorded (as the
tracker stores it). The tests compare them with metrics.jsonl and resolved.json.

- tensorboard: tensorboard's EventAccumulator (values are float32 there);
- wandb: the offline run's transaction log (<out>/wandb/offline-run-*/run-*.wandb). wandb 0.2x+
  ships no Python reader for it (its Go core writes it), so the LevelDB-log framing (its header
  ":W&B", 32 KiB blocks, 7-byte record headers) is unpacked here and each record parsed with
  wandb's own protobuf, ``wandb.proto.wandb_internal_pb2.Record``: the history records, and the
  run record's config;
- mlflow: MlflowClient on the run's SQLite store (metric histories, parameters);
- trackio: trackio's SQLiteStorage (get_logs, get_run_config) with TRACKIO_DIR at the run's;
- swanlab: SwanLab's DataStoreReader on the offline run's .swanlab file, each record parsed with
  its protobuf; the config is the run's files/config.yaml that SwanLab writes.
Reading only: nothing here writes to a run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def read(name: str, out_dir) -> tuple[dict, dict]:
    return READERS[name](Path(out_dir))


def tensorboard(out: Path) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    series = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return series, json.loads(text.strip().strip("`"))


def _leveldb_records(path: Path, ident: bytes):
    """The records of a LevelDB-log file with a 7-byte header starting with ``ident``."""
    data = path.read_bytes()
    assert data[:len(ident)] == ident, (path, data[:7])
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                      # a block's tail too short for a header: padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:          # zero fill to the end of the block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk    # FULL/FIRST start a record
        if kind in (1, 4):                                # FULL/LAST end it
            yield buf
            buf = b""


def wandb(out: Path) -> tuple[dict, dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    series: dict = defaultdict(dict)
    config: dict = {}
    for raw in _leveldb_records(path, b":W&B"):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                     for i in rec.history.item}
            step = int(items["_step"])
            for k, v in items.items():
                if not k.startswith("_"):
                    series[k][step] = v
        elif kind == "run":
            for item in rec.run.config.update:
                config[item.key] = json.loads(item.value_json)
    return dict(series), {k: v for k, v in config.items() if k != "_wandb"}


def mlflow(out: Path) -> tuple[dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + str((out / "mlflow.db").resolve()))
    run = client.get_run((out / "trackers" / "mlflow_run_id").read_text().strip())
    series = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
              for k in run.data.metrics}
    return series, dict(run.data.params)


def trackio(out: Path) -> tuple[dict, dict]:
    # trackio reads TRACKIO_DIR at import: read in a fresh interpreter pointed at the run's store
    code = ("import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage as S\n"
            f"run = {out.resolve().name!r}\n"
            "print(json.dumps([S.get_logs('earl_megatron', run), "
            "S.get_run_config('earl_megatron', run)]))")
    env = {**os.environ, "TRACKIO_DIR": str((out / "trackio").resolve())}
    text = subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                          capture_output=True).stdout
    logs, config = json.loads(text.strip().splitlines()[-1])
    series: dict = defaultdict(dict)
    for row in logs:
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                series[k][int(row["step"])] = v
    return dict(series), {k: v for k, v in config.items() if not k.startswith("_")}


def swanlab(out: Path) -> tuple[dict, dict]:
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = sorted(out.glob("swanlog/run-*/run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(path)
    series: dict = defaultdict(dict)
    try:
        while (raw := reader.scan()) is not None:
            rec = Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "scalar":
                series[rec.scalar.key][rec.scalar.step] = rec.scalar.value.number
    finally:
        reader.close()
    raw_config = yaml.safe_load((path.parent / "files" / "config.yaml").read_text())
    return dict(series), {k: v["value"] for k, v in raw_config.items()}


READERS = {"tensorboard": tensorboard, "wandb": wandb, "mlflow": mlflow, "trackio": trackio,
           "swanlab": swanlab}
