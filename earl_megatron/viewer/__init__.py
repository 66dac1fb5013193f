"""``earl view RUN_DIR``: a web page of a run (its metrics, the layouts each stage ran on, the
written episodes), served by the standard library from files shipped in this package.

rundir.py reads the run directory (pure, no HTTP); conversation.py cuts a sample into turns;
server.py is the HTTP side; static/ holds the page (HTML, CSS, JS; nothing fetched from the
network)."""
