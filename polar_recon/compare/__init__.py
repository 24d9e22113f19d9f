"""`polar-recon compare`: harnesses side by side over one or more stores, rollout outputs or log
directories (sources.py finds them, frames.py reads them column-wise, stats.py aggregates per
harness and weight version, training.py reads the trainer's log history, table.py / page.py print
and draw it). docs/report.md says what each number is."""
