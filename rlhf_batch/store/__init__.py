"""L2, the run on disk: its layout and ids, the schemas of every table, atomic writes, stage
manifests (the commit of a stage), model-directory checks and policy retention. Every run file
is read and written through here."""
