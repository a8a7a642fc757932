from services.signer.service import main

main()
