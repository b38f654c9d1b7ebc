"""Plain-data analysis stages: storages and categories, liveness, summary. No torch imports here."""
