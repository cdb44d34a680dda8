"""The HTML reports as a browser shows them: headless Chromium renders pareto.html and audit.html of a
real compile, keeps the screenshots under reports/bench/, and checks the text of the rendered DOM
(after the page's script ran): no reprs, 'nan' or 17-digit numbers, the threshold and the chosen plan.

Why a browser and not only the HTML text (tests/test_report.py checks that): a page people read must
load, lay out and run its sort script in the browser they use; a screenshot shows what they see.
Chromium: `apt-get install chromium` where missing (the step says so and stops, it never fakes a render).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import matplotlib.image
import pandas as pd

from luminal_num.compiler import compile
from luminal_num.error.budget import Budget
from luminal_num.models.registry import load_job
from luminal_num.report.audit import audit, write_audit_report
from luminal_num.report.compile_report import write_compile_report
from luminal_num.search.search import SearchOptions

from .summary import OUT, write_csv

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "headless_shell")
PAGES = ("pareto.html", "audit.html")
WINDOW = (1280, 1800)


NO_BROWSER = "headless Chromium not found: apt-get update && apt-get install -y chromium"


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def browser() -> str:
    exe = find_browser()
    if exe is None:
        raise SystemExit(NO_BROWSER)
    return exe


def _chromium(exe: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    flags = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage")
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=timeout)


def make_reports(folder: Path, model: str, candidates: int) -> tuple[Path, dict]:
    """compile + audit of `model` into `folder`, as the CLI writes them; returns the plan's numbers."""
    job = load_job(model)
    result = compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration,
                     SearchOptions(max_candidates=candidates, progress=False))
    write_compile_report(result, folder, f"{job.name}: error vs latency (h200)")
    write_audit_report(audit(result.plan, job.graph, list(job.heldout)), folder)
    return folder, result.plan.data


def _visible_text(dom: str) -> str:
    """The DOM without embedded images, scripts and tags: the text a reader sees."""
    dom = re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,", dom)
    dom = re.sub(r"<script.*?</script>", " ", dom, flags=re.S)
    return re.sub(r"<[^>]+>", " ", dom)


def render(folder: Path, plan: dict, exe: str) -> list[dict]:
    rows = []
    for page in PAGES:
        url = (folder / page).resolve().as_uri()
        shot = OUT / f"screenshot_{page.replace('.html', '')}.png"
        OUT.mkdir(parents=True, exist_ok=True)
        run = _chromium(exe, f"--screenshot={shot.resolve()}", f"--window-size={WINDOW[0]},{WINDOW[1]}", url)
        if run.returncode != 0 or not shot.exists():
            raise SystemExit(f"chromium could not render {page}: {run.stderr.strip()[-300:]}")
        dom = _chromium(exe, "--dump-dom", url).stdout
        text = _visible_text(dom)
        image = matplotlib.image.imread(shot)
        checks = {"no_repr": "np.float64(" not in text, "no_nan": not re.search(r"\bnan\b", text, re.I),
                  "no_long_digits": not re.search(r"\d{10,}", text)}
        if page == "pareto.html":
            checks["threshold_shown"] = f"threshold {plan['headroom']:g}" in text
            checks["chosen_shown"] = "chosen plan: candidate" in text
            checks["rows_rendered"] = dom.count("<tr") - 1 == plan["search"]["candidates"]
        else:
            checks["verdict_shown"] = "Audit: PASSED" in text or "Audit: CONTRACT BROKEN" in text
        rows.append({"page": page, "screenshot": str(shot), "width": image.shape[1], "height": image.shape[0],
                     "non_blank": bool(image.std() > 0.01), **checks,
                     "all_checks": all(checks.values()) and bool(image.std() > 0.01)})
    return rows


def run(model: str = "transformer", candidates: int = 20) -> dict:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    exe = browser()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        folder, plan = make_reports(Path(tmp) / "report", model, candidates)
        rows = render(folder, plan, exe)
    table = pd.DataFrame(rows).assign(browser=version, model=model)
    write_csv(table, "report_render.csv")
    return {f"{r['page']}: rendered by {version}, all checks": bool(r["all_checks"]) for r in rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--candidates", type=int, default=20)
    args = ap.parse_args(argv)
    figures = run(args.model, args.candidates)
    for k, v in figures.items():
        print(f"{k}: {v}")
    return figures


if __name__ == "__main__":
    main()
