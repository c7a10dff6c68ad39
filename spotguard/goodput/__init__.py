"""The goodput side: what a job spends its time on, the ledger it is written to, the report read from it,
and the adaptive cadence fed by it.

    recorder.py  GoodputRecorder: what a guard records (rank 0 writes; the others only feed the cadence)
    records.py   the ledger's typed records (one schema, versioned), shared by the writer and the report
    ledger.py    the ledger: rank 0's records of each run segment, written off the training thread
    report.py    `spotguard report`: goodput, lost steps, time to resume, from the ledger
    plot.py      the report's timeline picture (matplotlib, the `plot` extra)
    cadence.py   save_interval_s="auto": Young/Daly from measured stalls and the interruption rate
    timeline.py  what happened and when on this rank (printed by the demo)
"""
