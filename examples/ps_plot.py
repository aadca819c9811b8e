#!/usr/bin/env python3
"""Draw ps_train.py's loss curves (CSV: run,batch,loss) to a PNG, smoothed over 20 batches.

    python3 examples/ps_plot.py ps_train_curves.csv ps_train_curves.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOW = 20  # batches in the moving average (one batch's loss is noisy)


def plot(csv_path, png_path):
    runs = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            runs.setdefault(row["run"], []).append((int(row["batch"]), float(row["loss"])))
    for name, pts in sorted(runs.items()):
        pts.sort()
        ys = [v for _, v in pts]
        smooth = [sum(ys[max(0, i - WINDOW + 1):i + 1]) / len(ys[max(0, i - WINDOW + 1):i + 1])
                  for i in range(len(ys))]
        plt.plot([b for b, _ in pts], smooth, label=name)
    plt.xlabel("batch")
    plt.ylabel("training loss (moving average of %d)" % WINDOW)
    plt.legend()
    plt.savefig(png_path, dpi=100)
    print("wrote", png_path)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
