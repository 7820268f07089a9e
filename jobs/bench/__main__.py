"""``python -m eagleray.jobs.bench SUITE [options]``: the benchmark dispatcher (see the package doc)."""

from eagleray.jobs.bench import main

raise SystemExit(main())
