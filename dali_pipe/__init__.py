"""dali_pipe: S3 -> NVMe sync, a pre-flight image scan, and a DALI pipeline for Lightning.

Data flows one way through these modules:
  manifest (dataset.tsv) -> sync (S3 -> local disk) -> scan (bad files out)
    -> pipeline (DALI graph) -> loader (epoch-exact iterator) -> datamodule (Lightning)
  side paths: baseline (classic DataLoader), monitor + benchmark (timing), sagemaker (entry).
Importing the package is cheap: DALI, torch and boto3 load only where they are used.
"""
