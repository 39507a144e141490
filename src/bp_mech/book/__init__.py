"""What the chapter pages call to show results: ``report`` (cached records, tables, formatting),
``plots`` (the chapters' figures), ``memory_plots`` (the ledger and memory over time),
``project_plots`` (56's curves and the projects' figures). The pages explain; these only draw.
"""
