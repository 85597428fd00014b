"""Classification metrics from logits and labels, the confusion figure, and the summary lines.

The confusion matrix is torchmetrics'; precision, recall and F1 per class are read off it (a class
never predicted has precision 0, one never present has recall 0). Rows and columns cover the
classes that occur, as truth or as prediction: a 1000-class model evaluated on 5 classes gets a
readable matrix.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from dali_pipe.workdir import atomic, write_atomic

READABLE = 50  # up to this many classes the figure is a heatmap; beyond, a table of the top confusions


def compute(logits: torch.Tensor, labels: torch.Tensor, id2label: dict[int, str]) -> dict:
    """accuracy, top5 (5+ classes), loss, per_class precision/recall/F1/support, confusion with names."""
    from torchmetrics.functional.classification import multiclass_confusion_matrix

    logits, labels = logits.float(), labels.long()
    num_classes = logits.shape[1]
    pred = logits.argmax(1)
    out = {"images": int(labels.numel()), "accuracy": float((pred == labels).float().mean()),
           "loss": float(F.cross_entropy(logits, labels))}
    if num_classes >= 5:
        out["top5"] = float((logits.topk(5, dim=1).indices == labels[:, None]).any(1).float().mean())
    full = multiclass_confusion_matrix(pred, labels, num_classes)
    involved = sorted(set(labels.tolist()) | set(pred.tolist()))
    cm = full[involved][:, involved]
    names = [id2label.get(i, str(i)) for i in involved]
    per_class = {}
    for k, name in enumerate(names):
        tp = int(cm[k, k])
        predicted, support = int(cm[:, k].sum()), int(cm[k, :].sum())
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[name] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
    out["per_class"] = per_class
    out["confusion"] = {"classes": names, "matrix": cm.tolist(), "rows": "true class", "columns": "predicted class"}
    return out


def top_confusions(metrics: dict, n: int = 20) -> list[tuple[str, str, int]]:
    """The most frequent (true, predicted) pairs with true != predicted."""
    names, m = metrics["confusion"]["classes"], metrics["confusion"]["matrix"]
    pairs = [(names[i], names[j], m[i][j]) for i in range(len(names)) for j in range(len(names)) if i != j and m[i][j]]
    return sorted(pairs, key=lambda p: -p[2])[:n]


def summary(metrics: dict) -> str:
    worst = sorted(metrics["per_class"].items(), key=lambda kv: (kv[1]["f1"], kv[0]))[:3]
    lines = [f"evaluate: {metrics['images']} images, accuracy {metrics['accuracy']:.4f}"
             + (f", top-5 {metrics['top5']:.4f}" if "top5" in metrics else "") + f", loss {metrics['loss']:.4f}",
             "lowest F1: " + ", ".join(f"{k} {v['f1']:.2f} (support {v['support']})" for k, v in worst)]
    conf = top_confusions(metrics, 3)
    if conf:
        lines.append("most confused: " + ", ".join(f"{t} -> {p} ({c})" for t, p, c in conf))
    return "\n".join(lines)


SPLIT_WORDS = {"val": "validation split", "train": "training split", "all": "all images (train + val)"}


def write(metrics: dict, out: Path) -> None:
    """OUT/metrics.json and OUT/confusion.png (heatmap up to READABLE classes, else a top-confusions table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=1))
    fig = figure(metrics)
    try:
        with atomic(out / "confusion.png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def figure(metrics: dict):
    """The confusion matrix drawn (a heatmap up to READABLE classes, else a top-confusions table), titled with
    the split it counts, the images and the accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, m = metrics["confusion"]["classes"], metrics["confusion"]["matrix"]
    if len(names) <= READABLE:
        side = max(4.0, 0.35 * len(names) + 2)
        fig, ax = plt.subplots(figsize=(side + 1, side))
        im = ax.imshow(m, cmap="Blues")
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        if len(names) <= 20:
            top = max(max(r) for r in m) or 1
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    if v:
                        ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                                color="white" if v > top / 2 else "black")
        ax.set(xlabel="predicted class", ylabel="true class")
        fig.colorbar(im, ax=ax, fraction=0.046)
    else:
        rows = top_confusions(metrics, 30)
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
        ax.axis("off")
        if rows:
            table = ax.table(cellText=[[t, p, str(c)] for t, p, c in rows], colLabels=["true", "predicted", "images"],
                             loc="center", cellLoc="left")
            table.scale(1, 1.2)
        else:
            ax.text(0.5, 0.5, "no confusions", ha="center")
    split = SPLIT_WORDS.get(metrics.get("split"), "")
    ax.set_title(f"{split}{': ' if split else ''}{metrics['images']} images, accuracy {metrics['accuracy']:.3f}"
                 + ("" if len(names) <= READABLE else f"; top confusions of {len(names)} classes"))
    fig.tight_layout()
    return fig
