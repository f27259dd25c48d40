"""Regenerate docs/img/dashboard.png: a small cluster with two worker groups (one rank
running a blocking call, one group whose rank failed), the <dashboard>/daskwg page
shot with headless Chromium.

    PYTHONPATH=. python docs/make_screenshot.py   (needs chromium on PATH)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import dask.config
from distributed import Client, LocalCluster

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from workers import AddWorker  # noqa: E402

from daskwg import WorkerGroup  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "img", "dashboard.png")


def main() -> None:
    dask.config.set({"daskwg.dashboard.refresh": 0})
    with (
        LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        trainer = WorkerGroup(client, AddWorker, world_size=4, name="actor_rollout")
        critic = WorkerGroup(client, AddWorker, workers=trainer.workers[:2], name="critic")
        try:
            critic.fail_on(1, "loss is nan at step 12")
        except Exception:  # noqa: BLE001 - the failure is what the picture shows
            pass
        threading.Thread(target=trainer.execute_all_sync, args=("record", 1), kwargs={"delay": 20}).start()
        critic.record(2, delay=15)  # queued behind the trainer's call on the shared workers
        time.sleep(6)
        info = client.scheduler_info()
        url = f"http://127.0.0.1:{info['services']['dashboard']}/daskwg"
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--screenshot={OUT}",
                "--window-size=1280,620",
                url,
            ],
            check=True,
        )
        time.sleep(15)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
