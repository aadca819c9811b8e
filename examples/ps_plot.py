#!/usr/bin/env python3
"""Draw ps_train.py's loss curves (CSV: run,batch,loss) to a PNG, smoothed over 20 batches.
Rows whose run starts with "event:" (loss ignored) are drawn as dotted vertical lines named
after the rest of the run, e.g. "event:worker 1 killed".

    python3 examples/ps_plot.py ps_train_curves.csv ps_train_curves.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOW = 20  # batches in the moving average (one batch's loss is noisy)


def plot(csv_path, png_path):
    runs, events = {}, []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            if row["run"].startswith("event:"):
                events.append((int(row["batch"]), row["run"][len("event:"):]))
                continue
            runs.setdefault(row["run"], []).append((int(row["batch"]), float(row["loss"])))
    for name, pts in sorted(runs.items()):
        pts.sort()
        ys = [v for _, v in pts]
        smooth = [sum(ys[max(0, i - WINDOW + 1):i + 1]) / len(ys[max(0, i - WINDOW + 1):i + 1])
                  for i in range(len(ys))]
        plt.plot([b for b, _ in pts], smooth, label=name)
    for k, (b, what) in enumerate(sorted(events)):
        plt.axvline(b, linestyle=":", color="C%d" % (k + 2), label="%s (batch %d)" % (what, b))
    plt.xlabel("batch")
    plt.ylabel("training loss (moving average of %d)" % WINDOW)
    plt.legend()
    plt.savefig(png_path, dpi=100)
    print("wrote", png_path)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
